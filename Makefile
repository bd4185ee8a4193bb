# The two commands a newcomer needs: `make up` (local stack answering OpenAI requests on
# :8080) and `make test` (the whole suite). Both install what is missing first.
VENV := .venv
INSTALLED := $(VENV)/.installed

.PHONY: up test install

$(INSTALLED): pyproject.toml scripts/install.sh
	bash scripts/install.sh

install: $(INSTALLED)

up: $(INSTALLED)
	$(VENV)/bin/tito up

test: $(INSTALLED)
	$(VENV)/bin/python -m pytest -ra --durations=25 tests
