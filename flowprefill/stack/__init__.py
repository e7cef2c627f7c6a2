"""`flowprefill up`: the whole stack on one machine (supervisor, local vLLM decode, the
local SLO table, the malloc the prefill processes get)."""
