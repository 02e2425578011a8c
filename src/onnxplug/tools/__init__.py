"""Developer tools shipped with the package: the conformance harness, parity report."""
