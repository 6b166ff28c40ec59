"""The scripted inference engine now ships with the project (``warmstart/scripted_engine.py``: the teacher of #32
serves through it); the tests keep importing it from here."""

from warmstart.scripted_engine import EngineRequest, Responder, ScriptedEngine, ThreadedServer, tool_call_text

__all__ = ["EngineRequest", "Responder", "ScriptedEngine", "ThreadedServer", "tool_call_text"]
