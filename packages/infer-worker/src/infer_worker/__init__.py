"""The model runtime: loads weights, runs steps on a backend."""
