"""The job side: clients, data types, errors, input validation and the `Cluster` protocol.

Importing it never imports torch, ray or transformers (tests/test_api_pure.py): a controller,
or a network edge, can run where none of them is installed.
"""
