"""Gateway side: router, dispatch plan and combine, worker pool, server."""
