"""The OpenAI-compatible HTTP server: an asyncio front (AsyncEngine) on the engine thread, and the FastAPI app."""
