"""Report pieces: writing a suite's JSON, markdown and plot (`publish`), and the cells and plot
parts the suites' reports share (`format`)."""
