"""Test and list tooling shipped with the package (MPI harness, test-db lists)."""
