"""End-to-end tests: a real ``kvserve serve`` subprocess driven over HTTP."""
