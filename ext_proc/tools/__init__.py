"""Dev and operator tooling, never on the request path: `tito up` (`local_stack.py`),
`tito bench`, `tito conformance` (`conformance/`), `tito engines` and the tiny model. These
are clients of every API, so they may name each one."""
