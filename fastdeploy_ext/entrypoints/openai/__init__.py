"""The OpenAI-compatible server (FastAPI + uvicorn) over one ``LLMEngine``, in four modules:

- ``server.py``: request handling (``OpenAIServer``): parse, admit, build engine requests through the input
  processor (engine/processor.py), submit them to the engine loop, answer from its updates;
- ``engine_loop.py``: the one thread that owns the engine (``EngineLoop``): commands in, the engine's steps through
  the output processor (engine/output_processor.py), per-choice updates out; its statistics, the periodic log line
  and the Prometheus text;
- ``responses.py``: OpenAI response bodies and SSE chunks from those updates;
- ``app.py``: routes, error bodies and middleware (``build_app``), and serving with the shutdown drain
  (``run_server``).

Nothing but the engine-loop thread calls into the engine after start-up, except the input processor, which reads
only values fixed at construction; the server reads the engine's state through ``stats()`` and ``health()``.
"""
