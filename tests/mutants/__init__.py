"""Mutation proof: named mutants of the core, each killed by named tests."""
