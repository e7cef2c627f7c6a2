"""A small built-in English corpus for training the tiny models' byte-level BPE tokenizer.

Kept in the package (not downloaded) so the tokenizer, and therefore every token id the
tests and benchmarks see, is reproducible offline. The text only needs to give the BPE
trainer realistic words, punctuation, digits and code-like fragments to merge.
"""

from __future__ import annotations

CORPUS_TEXT = """\
A language model reads a prompt and writes an answer one token at a time. Before the first
token can be written, the whole prompt must pass through every layer of the network: this is
the prefill phase. For a short chat message the prefill takes a few milliseconds, but for a
long document it can take seconds, and while it runs every other request has to wait.
Serving systems therefore try to keep short, urgent requests from waiting behind long ones.
Some split long prompts into chunks; others stop between layers; FlowPrefill stops between
operators, which is the finest boundary that still keeps each kernel whole.

The scheduler keeps a queue of requests. Each request carries an arrival time, a deadline
and a predicted time to first token. The slack of a request is the time left before its
deadline minus the time it still needs. When a request with little slack arrives, the
scheduler raises a signal; the running task sees the signal at its next checkpoint,
acknowledges it, and parks. The urgent request runs, and later the parked task resumes
exactly where it stopped, with all of its activations and cache entries untouched.

Chat: "Hello! Can you summarise this file for me?" "Of course. The file describes a
pipeline with three stages: ingest, transform and publish. Each stage writes a log line."
Search: what is the tallest mountain in Europe? How many kilometres is it from Paris to
Berlin? Which rivers flow into the Black Sea? When was the first printed book made?
Image: a photo of a red bicycle leaning against a blue wall, a cat sleeping on a chair,
three children playing football in the rain, a bowl of soup with bread on the side.

The weather this morning was cold and clear. By noon the clouds had rolled in from the west,
and in the afternoon it rained heavily for an hour. The river rose, the streets were wet,
and the market traders packed up early. In the evening the sky cleared again and the stars
came out over the hills. Tomorrow will be warmer, with light winds from the south.

Numbers and units: 1, 2, 3, 10, 42, 100, 256, 1024, 4096, 65536; 0.5 seconds, 250 ms,
4.0 s, 6.5 s, 12 GiB, 80 GB, 3.14159, 2.71828, 99th percentile, 1e-5, 2K tokens, 8K tokens.
Dates: 2024-01-15, 2025-06-30, March 3rd, the 21st of October, Monday to Friday.

def prefill(prompts, model):
    outputs = []
    for prompt in prompts:
        logits = model(prompt).logits[:, -1, :]
        outputs.append(int(logits.argmax(dim=-1)))
    return outputs

class Request:
    def __init__(self, request_id: str, tokens: list[int], deadline_s: float) -> None:
        self.request_id = request_id
        self.tokens = tokens
        self.deadline_s = deadline_s

{"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi there"}], "stream": true}
GET /v1/models HTTP/1.1 200 OK; POST /v1/chat/completions; content-type: application/json.
kubectl get pods --namespace flowprefill-system; helm install; docker build -t image:latest .

Once upon a time there was a small town by the sea. The people there were fishermen and
bakers, carpenters and teachers. Every morning the boats went out before sunrise and came back
at noon, full of silver fish. The children ran down to the harbour to watch them unload,
and the gulls circled overhead, crying loudly. One winter a great storm came, and the waves
were higher than anyone had ever seen. The town worked together to pull the boats up the
beach, and when the storm had passed, they rebuilt the broken pier stone by stone.

Science notes: water boils at one hundred degrees Celsius at sea level. Light travels at
about three hundred thousand kilometres per second. The heart pumps blood through arteries
and veins; the lungs take in oxygen and release carbon dioxide. Plants turn sunlight, water
and carbon dioxide into sugar and oxygen. Electrons, protons and neutrons make up atoms.

Cooking: chop the onions and garlic, warm the olive oil in a heavy pan, and fry them gently
until soft. Add the tomatoes, a pinch of salt and pepper, and simmer for twenty minutes.
Meanwhile boil the pasta in plenty of salted water, drain it, and toss it with the sauce.
Serve with grated cheese and fresh basil. Bake the bread at two hundred degrees for forty
minutes, until the crust is golden and the loaf sounds hollow when tapped underneath.

Questions and answers. Why is the sky blue? Because air scatters blue light more than red.
Why do leaves change colour in autumn? Because the green chlorophyll breaks down and reveals
the yellow and orange pigments beneath. What makes a good teacher? Patience, clarity, and
real interest in how each student thinks. How do computers add numbers? With circuits of
logic gates that combine bits, carrying ones from column to column just as we do on paper.

The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Sphinx of black quartz, judge my vow. How vexingly quick daft zebras jump!
"""


def corpus_lines() -> list[str]:
    """The corpus split into non-empty lines (the unit the tokenizer trainer iterates)."""
    return [line for line in CORPUS_TEXT.splitlines() if line.strip()]
