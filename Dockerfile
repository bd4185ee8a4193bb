# The tito processor image (also runs the one-shot jobs of docker-compose.yml).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY ext_proc ext_proc
COPY scheduler scheduler
COPY render_sidecar render_sidecar
COPY protos protos
COPY envoy envoy
# Editable: the Envoy template and the generated stubs stay next to the code. The processor
# extra brings vLLM (CPU build: the processor only needs its tokenizer, detokenizer and
# parsers, at the render sidecar's version), transformers (the fallback tokenizer) and torch
# (the compose `model` job, `tito tiny-model`). tests/packaging runs these lines in a venv.
RUN pip install --no-cache-dir -e '.[processor]' && (pip uninstall -y torchvision torchaudio torchcodec || true)
RUN python -m protos.build
ENV HF_HUB_OFFLINE=1
ENTRYPOINT ["tito"]
CMD ["processor"]
