"""Roman numerals: conversion functions and a command line interface (see the task instruction)."""


def to_roman(n):
    raise NotImplementedError


def from_roman(s):
    raise NotImplementedError
