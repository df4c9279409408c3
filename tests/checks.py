"""Checks of a result against the reference (cases.Case.expected) that the test files
share: bit for bit, NaN where the reference has one, a case run through
convgrad.execute, and the problem a case resolves to.
"""

from __future__ import annotations

import numpy as np
from cases import DTYPES

import convgrad
from convgrad import api

DTYPE_NAMES = {np.dtype(dtype): name for name, dtype in DTYPES.items()}


def assert_exact(case, result):
    dtype = result.dtype
    expected = case.expected(dtype)
    assert result.shape == expected.shape
    np.testing.assert_array_equal(result.view(np.uint16 if dtype.itemsize == 2 else np.uint32),
                                  expected.view(np.uint16 if dtype.itemsize == 2 else np.uint32))


def assert_equal_with_nans(result, expected):
    """NaN exactly where `expected` has one (any payload), equal values elsewhere."""
    np.testing.assert_array_equal(np.isnan(result), np.isnan(expected))
    np.testing.assert_array_equal(result[~np.isnan(result)], expected[~np.isnan(expected)])


def run_case(case, **kwargs):
    result = convgrad.execute(case.op, case.inputs, case.attrs, **kwargs)
    assert_exact(case, result)
    return result


def problem_of(case):
    return api.resolve(case.op, [x.shape for x in case.inputs[:2]], case.attrs,
                       case.inputs[2] if len(case.inputs) > 2 else None,
                       DTYPE_NAMES[case.inputs[0].dtype])
