"""`serve`: the HTTP server and the service that outlives the ranks."""
