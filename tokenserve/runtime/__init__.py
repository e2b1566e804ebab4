"""Shared service runtime: server bootstrap, logging, metrics, errors."""
