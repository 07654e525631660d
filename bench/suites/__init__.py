"""One module per benchmark suite, each with `main(argv)`; `python -m bench.run --list` names
them."""
