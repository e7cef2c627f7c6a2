"""No prompt or completion text (nor the prompt's token ids) in any log line.

Real requests carrying a distinctive marker go through the in-process gateway and prefill
servers (tests/helpers.local_stack: uvicorn, FastAPI, the engine, the tiny model) with every
logger at DEBUG and stdout/stderr captured: good requests, streamed ones, requests that fail
validation (pydantic's errors carry ``input_value``), malformed JSON, tokenizer calls, a
direct prefill call, and an unexpected exception whose message echoes the prompt (as a
tokenizer's error might). The marker must not appear anywhere; request ids may.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from flowprefill.models import named_model_dir
from tests.helpers import local_stack

MARKER = "zebra-quokka-7731"
PROMPT = f"Please summarise the secret plan {MARKER} for me"
SLO_TABLE = {
    "version": 1,
    "default_class": "chat",
    "classes": [
        {
            "name": "chat",
            "task_type": "text",
            "ttft_slo_ms": 60000,
            "priority": 0,
            "attainment_target": 0.9,
        }
    ],
}


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.threadName == "MainThread" and record.name.startswith(("httpx", "httpcore")):
            return  # this test's own client logging what it sent and got; servers run in threads
        # format() adds the traceback of log.exception(); getMessage() the % arguments.
        self.lines.append(logging.Formatter("%(name)s %(levelname)s %(message)s").format(record))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    model_dir = named_model_dir("tiny-llama", cache_dir=tmp_path_factory.mktemp("models"))
    table = tmp_path_factory.mktemp("gateway") / "slo-table.json"
    table.write_text(json.dumps(SLO_TABLE))
    with local_stack(model_dir, table, num_prefill=1) as s:
        yield s


@pytest.fixture
def logs(stack: dict[str, Any]) -> Iterator[Capture]:
    """Every logger at DEBUG into one handler, on the root and on loggers that do not
    propagate (uvicorn's)."""
    capture = Capture()
    loggers = [logging.getLogger()] + [
        logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
    ]
    saved = [(lg, lg.level) for lg in loggers]
    hooked = [lg for lg in loggers if lg is logging.getLogger() or not lg.propagate]
    for lg in loggers:
        lg.setLevel(logging.DEBUG)
    for lg in hooked:
        lg.addHandler(capture)
    try:
        yield capture
    finally:
        for lg, level in saved:
            lg.setLevel(level)
        for lg in hooked:
            lg.removeHandler(capture)


def _drive(stack: dict[str, Any]) -> list[httpx.Response]:
    gw, prefill = stack["url"], stack["prefill_urls"][0]
    ids = stack["state"].tokenizer.encode_prompt(PROMPT)
    with httpx.Client(timeout=60) as c:
        post = c.post
        answers = [
            # Served: plain, streamed, chat.
            post(f"{gw}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1}),
            post(
                f"{gw}/v1/completions",
                json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "stream": True},
            ),
            post(
                f"{gw}/v1/chat/completions",
                json={
                    "model": "tiny",
                    "messages": [{"role": "user", "content": PROMPT}],
                    "max_tokens": 1,
                },
            ),
            # Refused by validation: pydantic's errors carry the input value.
            post(f"{gw}/v1/completions", json={"model": "tiny", "prompt": [PROMPT, 3]}),
            post(
                f"{gw}/v1/completions",
                json={"model": "tiny", "prompt": PROMPT, "max_tokens": MARKER},
            ),
            post(f"{gw}/v1/completions", json={"model": "tiny", "prompt": {"text": PROMPT}}),
            post(
                f"{gw}/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": MARKER, "content": PROMPT}]},
            ),
            post(f"{gw}/v1/completions", json={"model": MARKER, "prompt": PROMPT, "max_tokens": 1}),
            post(
                f"{gw}/v1/completions",
                json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "slo_class": MARKER},
            ),
            post(
                f"{gw}/v1/completions",
                json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1},
                headers={"x-slo-class": MARKER},
            ),
            # Not JSON at all, and JSON cut off inside the prompt.
            post(
                f"{gw}/v1/completions",
                content=f'{{"prompt": "{PROMPT}'.encode(),
                headers={"content-type": "application/json"},
            ),
            post(
                f"{gw}/v1/completions",
                content=PROMPT.encode(),
                headers={"content-type": "text/plain"},
            ),
            # Tokenizer endpoints.
            post(f"{gw}/tokenize", json={"model": "tiny", "prompt": PROMPT}),
            post(f"{gw}/tokenize", json={"model": "tiny", "prompt": PROMPT, "bogus": MARKER}),
            post(f"{gw}/detokenize", json={"model": "tiny", "tokens": [*ids[:3], MARKER]}),
            # The prefill server itself: served, and refused.
            post(
                f"{prefill}/v1/prefill",
                json={"request_id": "direct-1", "prompt_token_ids": ids, "ttft_slo_s": 60},
            ),
            post(
                f"{prefill}/v1/prefill",
                json={
                    "request_id": "direct-2",
                    "prompt_token_ids": [*ids, MARKER],
                    "ttft_slo_s": 60,
                },
            ),
            post(f"{prefill}/v1/prefill", json={"request_id": MARKER, "prompt_token_ids": ids}),
        ]
    return answers


def _assert_clean(text: str, ids: list[int], where: str) -> None:
    assert MARKER not in text, f"prompt text in the {where}"
    # The prompt's token ids, however a list of them would be printed.
    for sep in (", ", ",", " "):
        run = sep.join(map(str, ids[2:8]))
        assert run not in text, f"prompt token ids in the {where}: {run}"


def test_no_prompt_text_or_token_ids_in_logs(
    stack: dict[str, Any], logs: Capture, capfd: pytest.CaptureFixture[str]
) -> None:
    answers = _drive(stack)
    statuses = [r.status_code for r in answers]
    served, refused = [0, 1, 2, 12, 15], [3, 4, 5, 6, 7, 10, 11, 14, 16, 17]
    assert [statuses[i] for i in served] == [200] * len(served), statuses
    assert all(400 <= statuses[i] < 500 for i in refused), statuses
    completion = answers[0].json()["choices"][0]["text"]
    ids = stack["state"].tokenizer.encode_prompt(PROMPT)
    assert len(ids) >= 8
    out, err = capfd.readouterr()
    text = "\n".join(logs.lines)
    assert logs.lines, "nothing was logged: the capture is not hooked up"
    for where, captured in (("logs", text), ("stdout", out), ("stderr", err)):
        _assert_clean(captured, ids, where)
    if len(completion.strip()) >= 4:  # a one-token completion too short to tell apart
        assert completion not in text


def test_an_exception_that_echoes_the_prompt_is_logged_without_it(
    stack: dict[str, Any], logs: Capture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure nobody anticipated (here: the tokenizer raising with its input in the
    message, as tokenizers do) is a 500 whose log names the error and where, not the text."""
    tokenizer = stack["state"].tokenizer

    def broken(text: str, *args: Any, **kwargs: Any) -> list[int]:
        raise ValueError(f"cannot encode {text!r}")

    monkeypatch.setattr(tokenizer, "encode_prompt", broken)
    r = httpx.post(
        f"{stack['url']}/v1/completions",
        json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1},
        timeout=60,
    )
    assert r.status_code == 500
    assert MARKER not in r.text
    text = "\n".join(logs.lines)
    assert "ValueError" in text, "the failure is still logged"
    assert MARKER not in text


def test_decode_is_launched_without_request_logging(tmp_path: Path) -> None:
    """vLLM logs prompts (DEBUG) and outputs only with --enable-log-requests /
    --enable-log-outputs: the decode commands we launch, parsed by vLLM's own parser,
    leave both off."""
    pytest.importorskip("vllm")
    from flowprefill_operator.builders.processes import pool_process
    from flowprefill_operator.models import ServingPoolSpec
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from flowprefill.contracts import KVTransport
    from flowprefill.stack.decode import decode_spec

    local = decode_spec(tmp_path / "demo-llama", 8200, tmp_path / "kv", transport=KVTransport.HTTP)
    pod = pool_process(
        ServingPoolSpec.model_validate(
            {"service": "s", "role": "decode", "model": {"path": "/models/m"}}
        )
    )
    parser = make_arg_parser(FlexibleArgumentParser())
    for argv in (local.args, pod.args):
        args = parser.parse_args(list(argv))
        assert args.enable_log_requests is False, argv
        assert args.enable_log_outputs is False, argv
