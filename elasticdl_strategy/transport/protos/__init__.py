"""Protocol buffer and gRPC modules generated from the ``.proto`` files beside them.

Regenerate after editing a ``.proto`` (``tests/transport/test_protos.py`` fails until you do)::

    python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. \\
        elasticdl_strategy/transport/protos/*.proto
"""
