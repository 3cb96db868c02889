"""Scripts run by the Makefile (`make demo`, `make demo-compose`); `composehosts` is shared with the tests."""
