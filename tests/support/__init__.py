"""Helpers the tests share: clusters, bounded waits, processes, machines and writers.

One module per idea (:mod:`tests.support.polling` waits, :mod:`tests.support.cluster`
starts a local cluster, :mod:`tests.support.processes` stops one); test files import
them as ``from tests.support.x import y``.  Nothing here is a test: pytest collects only
the ``test_*.py`` files beside this package.
"""
