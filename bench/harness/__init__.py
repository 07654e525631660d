"""The benchmark machinery the suites share: stages in processes of their own, engine workers,
`vllm serve` servers, checkpoints, machine facts and reports (docs/benchmarks/README.md)."""
