"""nmtflow: neural machine translation research on information flow."""
__version__ = "0.1.0"
