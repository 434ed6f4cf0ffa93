.PHONY: test test-vllm demo
test:       ## whole default suite (.venv)
	./scripts/test
test-vllm:  ## real-vLLM 0.33 suite on CPU (.venv-vllm, ~2.2 GB)
	./scripts/test-vllm
demo:
	./scripts/demo
