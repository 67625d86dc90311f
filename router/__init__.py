"""The router: API front ends, cascade, picking a worker, the index and registry clients."""
