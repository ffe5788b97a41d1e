from examples.adult_income.model import WideAndDeep

__all__ = ["WideAndDeep"]
