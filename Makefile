# The README's two commands: `make localnet` and `make test`. Each sets itself up on a fresh machine.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
# CPU wheel lying on disk on these machines; override on a GPU host (TORCH_SPEC="torch").
TORCH_SPEC ?= torch==2.13.0
DATA   ?= $(firstword $(wildcard ../shared/data/wikitext-2/wiki.valid.raw.txt))
STEPS  ?= 150
OUT    ?= runs/localnet

.PHONY: setup browser nat lint test test-slow localnet colocated bench clean

setup: $(VENV)/.installed browser nat

# Debian's chromium + chromium-driver for the dashboard's browser test (tests/test_ops_localnet.py).
# Needs apt-get as root; where it cannot install them it says so and that test skips with the reason.
browser:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  echo "installing Debian's chromium and chromium-driver (dashboard browser test)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null) \
	    || echo "could not install chromium: the dashboard browser test will skip"; \
	else echo "no chromium and no root apt-get: the dashboard browser test will skip"; fi

# Debian's iptables for the home-behind-a-NAT test (tests/test_relay_nat.py: masquerading router namespaces).
# Needs apt-get as root; where it cannot install it, it says so and that test skips with the reason.
nat:
	@if command -v iptables >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  echo "installing Debian's iptables (NAT test)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iptables >/dev/null) \
	    || echo "could not install iptables: the NAT test will skip"; \
	else echo "no iptables and no root apt-get: the NAT test will skip"; fi

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

test: setup lint
	$(PY) -m pytest -q -rfEs --durations=25 -m "not slow" tests

# The layers (.importlinter): protocol at the bottom, transport apart from algorithms, miner and validator
# apart, simulation and devnet only under the entry points, no import cycles. State is set in
# __init__: no attribute is first set elsewhere (pylint W0201, attribute-defined-outside-init).
lint: setup
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/pylint --disable=all --enable=W0201 --score=n iota_subnet

test-slow: setup
	$(PY) -m pytest -q -rfEs --durations=40 -m slow tests

localnet: setup
	$(VENV)/bin/iota-subnet localnet --stages 3 --replicas 2 --validators 1 \
	  --config configs/tiny.yaml $(if $(DATA),--data $(DATA)) --steps $(STEPS) --out $(OUT)

colocated: setup
	$(VENV)/bin/iota-subnet train-colocated --config configs/tiny.yaml $(if $(DATA),--data $(DATA)) \
	  --steps $(STEPS) --out runs/colocated

clean:
	rm -rf $(VENV) runs .pytest_cache
