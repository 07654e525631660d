"""Execution of the Metal kernel sources on the host: MSL stand-in headers, grid runner, tests."""
