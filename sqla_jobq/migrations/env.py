from sqla_jobq.migrations.environment import run

run()
