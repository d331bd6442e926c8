"""Helpers shared by the test suite, one concept a module:

- ``paths``: where the checkout and its local services' script are
- ``services``: the shared PostgreSQL and Kafka the tests use (found, or started)
- ``names``: names no other test uses
- ``kafka``: topics created and deleted, and read back
- ``postgres``: a streaming session's DSN, transactions streamed, goharvest's own outbox table
- ``ports``: free loopback ports for a test's private services
- ``private_services``: a broker or PostgreSQL cluster of a test's own, to restart or stop
- ``harvesters``: harvesters built for a test, led by an elector the test drives by hand
- ``reaper``: the ``reaper`` command run from this checkout
- ``wheel``: this project's wheel, built once per test session
"""
