"""docker-compose integration tests (marker ``compose``; ``make test-compose``)."""
