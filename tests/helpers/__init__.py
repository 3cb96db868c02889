"""Helpers the test files of several tiers import (none of them is a test): an in-process agent and a
lying peer, fuzzing strategies, received objects, grant worlds, transport fixtures, commands in a guest.
What the benchmarks share with the tests is in ``testkit``."""
