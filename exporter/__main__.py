from exporter.cli import run

run()
