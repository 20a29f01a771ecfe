def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes several seconds (multi-process jobs, 64 MiB tensors)")
