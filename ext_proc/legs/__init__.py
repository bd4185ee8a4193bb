"""A request's engine calls the processor makes itself: the Handoff prefill leg
(`prefill.py`), Trigger's metaserver callback (`trigger.py`), generate calls (`generate.py`),
a batch's fan-out and merge (`fanout.py`), one prompt's relayed stream (`relay.py`) and one
prompt's beam search (`beam.py`)."""
