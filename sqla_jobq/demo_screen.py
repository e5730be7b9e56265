"""`jobq demo` in a terminal: progress bars, the lease story, a closing table (internal).

The scenarios (demo.py) print nothing; this module only shows what they
report. rich comes with typer, so it adds no dependency.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress
from rich.table import Table as Table_
from rich.text import Text

from .demo import (
    CLAIM_BATCH,
    NAIVE_CLAIM,
    DemoResult,
    LeaseResult,
    Progress,
    RaceResult,
    Screen,
    shares_of,
)


class RichScreen(Screen):
    """The demo in a terminal: a progress bar per phase, the story, a final table.

    rich comes with typer, so this adds no dependency.
    """

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(highlight=False)

    def start(self, server: str, schema: str, jobs: int, workers: int) -> None:
        self.console.print(f"[bold]sqla_jobq demo[/]: {jobs:,} jobs, {workers} workers")
        self.console.print(f"[dim]server  {escape(server)}[/]")
        self.console.print(f"[dim]schema  {schema} (scratch, dropped at the end)[/]")

    def _heading(self, number: int, title: str) -> None:
        self.console.print()
        self.console.print(f"[bold cyan]{number}. {escape(title)}[/]")

    @contextmanager
    def _bar(self, label: str, total: int) -> Iterator[Progress]:
        columns = (
            TextColumn(f"   {label:<7}"),
            BarColumn(bar_width=36),
            TextColumn("{task.completed:>7,.0f}/{task.total:,.0f}"),
            TimeElapsedColumn(),
        )
        with RichProgress(*columns, console=self.console) as bar:
            task = bar.add_task(label, total=total)
            yield lambda n: bar.update(task, completed=n)

    @contextmanager
    def naive(self, jobs: int, workers: int) -> Iterator[Progress]:
        shares = shares_of(jobs, workers)
        self._heading(1, "The naive claim, run as the article runs it with pgbench")
        self.console.print(
            f"   {workers} clients x {shares[0]:,} claims, each in its own BEGIN ... COMMIT:"
        )
        for line in NAIVE_CLAIM.splitlines():
            self.console.print(f"     [yellow]{escape(line)}[/]")
        with self._bar("claims", jobs) as progress:
            yield progress

    def naive_done(self, result: RaceResult) -> None:
        self.console.print(
            f"   [red]✗[/] {result.claims:,} claims finished only [bold]{result.done:,}[/] jobs; "
            f"{result.queued:,} are still queued."
        )
        self.console.print(
            f"     One job was handed out [bold]{result.max_taken} times[/]; "
            f"{result.taken_more_than_once:,} jobs went to more than one worker."
        )

    @contextmanager
    def skip_locked(self, jobs: int, workers: int) -> Iterator[Progress]:
        self._heading(2, "The same race with FOR UPDATE SKIP LOCKED")
        self.console.print(
            f"   {workers} workers: statements.claim ({CLAIM_BATCH} at a time), then "
            "statements.complete_many,"
        )
        self.console.print("   each one statement in autocommit, until the queue is empty:")
        with self._bar("done", jobs) as progress:
            yield progress

    def skip_locked_done(self, result: RaceResult) -> None:
        once = "each exactly once" if result.max_taken == 1 else f"max {result.max_taken} times"
        good = result.done == result.jobs and result.max_taken == 1
        mark = "[green]✓[/]" if good else "[red]✗[/]"
        self.console.print(
            f"   {mark} [bold]{result.done:,}[/] of {result.jobs:,} jobs done, {once}, "
            f"{result.done_per_second:,.0f} jobs/s."
        )

    def lease(self) -> None:
        self._heading(3, "A lease runs out under a stalled worker")

    def say(self, line: str) -> None:
        text = Text("   " + line)
        text.highlight_regex(r"UPDATE 0", "bold red")
        text.highlight_regex(r"UPDATE 1", "bold green")
        text.highlight_regex(r"attempts = \d+", "bold")
        self.console.print(text)

    def lease_done(self, result: LeaseResult) -> None:
        fenced = result.stale_rowcount == 0 and result.owner_rowcount == 1
        mark = "[green]✓[/]" if fenced else "[red]✗[/]"
        self.console.print(
            f"   {mark} job {result.job_id} {result.final_status} once, after "
            f"{result.final_attempts} attempts; the stale completion changed nothing."
        )

    def finish(self, result: DemoResult) -> None:
        self.console.print()
        self.console.print(summary_table(result))
        self.console.print(f"[dim]scratch schema {result.schema} dropped[/]")


def summary_table(result: DemoResult) -> Table_:
    table = Table_(title="Same queue, same workers", title_justify="left", title_style="bold")
    table.add_column("claim")
    for name in ("claims", "done", "queued", "max taken", "done/s"):
        table.add_column(name, justify="right")
    rows = (
        ("naive claim", result.naive, "red"),
        ("SKIP LOCKED", result.skip_locked, "green"),
    )
    for label, race, style in rows:
        table.add_row(
            label,
            f"{race.claims:,}",
            f"[{style}]{race.done:,}[/]",
            f"{race.queued:,}",
            f"[{style}]{race.max_taken}[/]",
            f"{race.done_per_second:,.0f}",
        )
    return table
