"""The device the tests run the library on: TINYLOOP_TEST_DEVICE, the CPU by default (the
GPU check sets it to cuda, docs/testing.md)."""

import os

DEVICE = os.environ.get("TINYLOOP_TEST_DEVICE", "cpu")
ON_CPU = DEVICE == "cpu"
