"""The shared-tier fixtures of the hostile-peer stories, for every file of them here."""

from store.test_untrusted import backend, servers  # noqa: F401  (fixtures)
