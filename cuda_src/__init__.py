"""CUDA C++ sources of cupyflash, shipped as package data and compiled by NVRTC."""
