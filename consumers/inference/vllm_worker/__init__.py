"""Code that runs inside a real vLLM server's worker processes, not in clawstream's own processes.

``clawstream_vllm_worker.ClawstreamWorkerExtension`` is loaded by vLLM through ``--worker-extension-cls`` (see
``consumers.inference.vllm_server.serve``, which puts this directory on the server's ``PYTHONPATH``). The module
imports only the standard library at import time; it is imported by vLLM's interpreter (its own virtualenv), never by
clawstream's.
"""
