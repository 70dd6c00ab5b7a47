"""OpenAI-compatible HTTP serving of a :class:`~dflash_torch.engine.DFlashEngine`:
``create_app(engine, api_key=None, model_name=None)`` builds the FastAPI app and
``dflash-torch serve`` runs it with uvicorn.

``create_app`` is imported on first use, so the other subcommands (and machines
without the HTTP stack) never import FastAPI."""

__all__ = ["create_app"]


def __getattr__(name: str):
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
