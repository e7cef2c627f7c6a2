"""A whole stack (``flowprefill up``) under load, against vLLM alone; ``common`` starts and
stops them."""
