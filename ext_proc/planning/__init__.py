"""One pipeline request in, one `Plan` out (`planner.py`): tokenize, budget (`budget.py`),
which prefill/decode topology to try (`topology.py`, pure), pick and commit on the pure
`scheduler/`. No protos, no Envoy, no client API: its only I/O is tokenization."""
