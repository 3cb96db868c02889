"""The host agent: HCP and management calls over HTTP (FastAPI)."""
