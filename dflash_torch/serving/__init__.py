"""OpenAI-compatible HTTP serving of a :class:`~dflash_torch.engine.DFlashEngine`:
``create_app(engine, api_key=None, model_name=None)`` builds the FastAPI app and
``dflash-torch serve`` runs it with uvicorn."""

from .app import create_app

__all__ = ["create_app"]
