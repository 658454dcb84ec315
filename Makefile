# Quick start: `make run` (set up .venv/ and run the main job), `make test` (set up and run the tests).
.PHONY: setup run test

VENV := .venv

setup:
	./scripts/setup.sh test

run:
	./scripts/setup.sh run
	$(VENV)/bin/gyre-orchestrate run

test: setup
	$(VENV)/bin/python -m pytest
