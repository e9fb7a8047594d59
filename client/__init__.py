"""Python client for Pagoda's pagoda.v1.Generation API."""
