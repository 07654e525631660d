"""`python -m bench.sliding_window_blocks`, kept for tests/kv/test_sliding_window_blocks.py: the
suite is `python -m bench.run sliding_window_blocks` (bench/suites/sliding_window_blocks.py)."""

from bench.suites.sliding_window_blocks import main

if __name__ == "__main__":
    raise SystemExit(main())
