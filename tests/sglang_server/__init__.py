"""sglang's own servers with kvbeam as the transfer backend (tests/host/test_sglang_server.py)."""
