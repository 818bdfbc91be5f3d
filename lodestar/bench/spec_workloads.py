"""Prompts of ``lodestar bench spec``: source files to edit or extend, and plain chat questions.

The edit tasks put a whole source file in the user message and ask for it back with a small
change (a rename) or whole and then extended, so most of the answer copies the prompt:
the case prompt-lookup drafting is for. The chat questions copy nothing, so drafting should
find little and the adaptive gamma should switch it off.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SourceFile:
    name: str
    language: str              # the code fence's language tag
    text: str
    rename: tuple[str, str]    # a function's name, and the one the rename task gives it
    extension: str             # what the extend task asks to add after the unchanged file


@dataclass(frozen=True)
class Task:
    """One benchmark prompt: a user message sent through the chat template."""

    part: str                  # "edit" or "chat"
    name: str
    message: str


INVENTORY_PY = '''"""Warehouse inventory: load stock records, restock, and value what is on the shelves."""
from __future__ import annotations

import csv
import logging
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_REORDER_LEVEL = 10
CURRENCY = "EUR"


class InventoryError(ValueError):
    """A stock record that cannot be read or an operation the stock does not allow."""


@dataclass
class Item:
    sku: str
    name: str
    quantity: int
    unit_price: float
    reorder_level: int = DEFAULT_REORDER_LEVEL
    tags: list[str] = field(default_factory=list)

    def needs_restock(self) -> bool:
        return self.quantity <= self.reorder_level

    def value(self) -> float:
        return self.quantity * self.unit_price


@dataclass
class Inventory:
    items: dict[str, Item] = field(default_factory=dict)
    updated: date | None = None

    def add(self, item: Item) -> None:
        if item.sku in self.items:
            raise InventoryError(f"duplicate SKU {item.sku!r}")
        self.items[item.sku] = item

    def get(self, sku: str) -> Item:
        try:
            return self.items[sku]
        except KeyError:
            raise InventoryError(f"unknown SKU {sku!r}") from None

    def remove(self, sku: str, quantity: int) -> Item:
        item = self.get(sku)
        if quantity > item.quantity:
            raise InventoryError(f"cannot take {quantity} of {sku}: only {item.quantity} in stock")
        item.quantity -= quantity
        self.updated = date.today()
        return item


def parse_row(row: dict[str, str], line: int) -> Item:
    try:
        quantity = int(row["quantity"])
        price = float(row["unit_price"])
    except (KeyError, ValueError) as e:
        raise InventoryError(f"line {line}: bad record ({e})") from None
    if quantity < 0 or price < 0:
        raise InventoryError(f"line {line}: negative quantity or price")
    level = int(row.get("reorder_level") or DEFAULT_REORDER_LEVEL)
    tags = [t.strip() for t in row.get("tags", "").split(";") if t.strip()]
    return Item(row["sku"].strip(), row["name"].strip(), quantity, price, level, tags)


def load_inventory(path: Path) -> Inventory:
    inventory = Inventory()
    with path.open(newline="", encoding="utf-8") as f:
        for line, row in enumerate(csv.DictReader(f), start=2):
            inventory.add(parse_row(row, line))
    inventory.updated = date.today()
    log.info("loaded %d items from %s", len(inventory.items), path)
    return inventory


def restock_items(inventory: Inventory, supplier_stock: dict[str, int]) -> list[str]:
    """Top up every item at or below its reorder level from the supplier's stock."""
    restocked = []
    for sku, item in sorted(inventory.items.items()):
        if not item.needs_restock():
            continue
        available = supplier_stock.get(sku, 0)
        wanted = item.reorder_level * 2 - item.quantity
        amount = min(wanted, available)
        if amount <= 0:
            log.warning("no supplier stock for %s", sku)
            continue
        item.quantity += amount
        supplier_stock[sku] = available - amount
        restocked.append(sku)
    if restocked:
        inventory.updated = date.today()
    return restocked


def compute_total_value(inventory: Inventory, tag: str | None = None) -> float:
    """The value of the stock, or of the items with ``tag`` only."""
    total = 0.0
    for item in inventory.items.values():
        if tag is None or tag in item.tags:
            total += item.value()
    return round(total, 2)


def report(inventory: Inventory) -> str:
    lines = [f"{'SKU':<10}{'name':<24}{'qty':>6}{'value':>12}"]
    for item in sorted(inventory.items.values(), key=lambda i: i.sku):
        flag = " *" if item.needs_restock() else ""
        lines.append(f"{item.sku:<10}{item.name:<24}{item.quantity:>6}{item.value():>12.2f}{flag}")
    lines.append(f"total value: {compute_total_value(inventory):.2f} {CURRENCY}")
    return "\\n".join(lines)


def save_inventory(inventory: Inventory, path: Path) -> None:
    fields = ["sku", "name", "quantity", "unit_price", "reorder_level", "tags"]
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for item in inventory.items.values():
            writer.writerow({"sku": item.sku, "name": item.name, "quantity": item.quantity,
                             "unit_price": item.unit_price, "reorder_level": item.reorder_level,
                             "tags": ";".join(item.tags)})
'''

RATE_LIMITER_JS = '''// Token-bucket rate limiting for an HTTP API, as Express middleware.
'use strict';

const DEFAULT_CAPACITY = 60;
const DEFAULT_REFILL_PER_SECOND = 1;

class RateLimitError extends Error {
  constructor(retryAfterSeconds) {
    super(`rate limit exceeded, retry in ${retryAfterSeconds}s`);
    this.name = 'RateLimitError';
    this.retryAfterSeconds = retryAfterSeconds;
  }
}

class TokenBucket {
  constructor(capacity = DEFAULT_CAPACITY, refillPerSecond = DEFAULT_REFILL_PER_SECOND, now = Date.now) {
    if (capacity <= 0 || refillPerSecond <= 0) {
      throw new RangeError('capacity and refill rate must be positive');
    }
    this.capacity = capacity;
    this.refillPerSecond = refillPerSecond;
    this.now = now;
    this.tokens = capacity;
    this.lastRefill = now();
  }

  refillTokens() {
    const current = this.now();
    const elapsed = (current - this.lastRefill) / 1000;
    if (elapsed <= 0) {
      return;
    }
    this.tokens = Math.min(this.capacity, this.tokens + elapsed * this.refillPerSecond);
    this.lastRefill = current;
  }

  tryTake(cost = 1) {
    this.refillTokens();
    if (this.tokens >= cost) {
      this.tokens -= cost;
      return true;
    }
    return false;
  }

  secondsUntil(cost = 1) {
    this.refillTokens();
    const missing = cost - this.tokens;
    return missing <= 0 ? 0 : Math.ceil(missing / this.refillPerSecond);
  }
}

class RateLimiter {
  constructor({ capacity, refillPerSecond, maxClients = 10000, now = Date.now } = {}) {
    this.capacity = capacity || DEFAULT_CAPACITY;
    this.refillPerSecond = refillPerSecond || DEFAULT_REFILL_PER_SECOND;
    this.maxClients = maxClients;
    this.now = now;
    this.buckets = new Map();
  }

  bucketFor(clientId) {
    let bucket = this.buckets.get(clientId);
    if (bucket === undefined) {
      if (this.buckets.size >= this.maxClients) {
        const oldest = this.buckets.keys().next().value;
        this.buckets.delete(oldest);
      }
      bucket = new TokenBucket(this.capacity, this.refillPerSecond, this.now);
      this.buckets.set(clientId, bucket);
    }
    return bucket;
  }

  check(clientId, cost = 1) {
    const bucket = this.bucketFor(clientId);
    if (!bucket.tryTake(cost)) {
      throw new RateLimitError(bucket.secondsUntil(cost));
    }
    return Math.floor(bucket.tokens);
  }
}

function clientKey(req) {
  const apiKey = req.get('x-api-key');
  if (apiKey) {
    return `key:${apiKey}`;
  }
  const forwarded = (req.get('x-forwarded-for') || '').split(',')[0].trim();
  return `ip:${forwarded || req.ip}`;
}

function rateLimit(options = {}) {
  const limiter = new RateLimiter(options);
  const costOf = options.costOf || (() => 1);
  return function rateLimitMiddleware(req, res, next) {
    try {
      const remaining = limiter.check(clientKey(req), costOf(req));
      res.set('X-RateLimit-Limit', String(limiter.capacity));
      res.set('X-RateLimit-Remaining', String(remaining));
      next();
    } catch (err) {
      if (!(err instanceof RateLimitError)) {
        next(err);
        return;
      }
      res.set('Retry-After', String(err.retryAfterSeconds));
      res.status(429).json({ error: { type: 'rate_limited', message: err.message } });
    }
  };
}

module.exports = { RateLimitError, TokenBucket, RateLimiter, clientKey, rateLimit };
'''

LRU_GO = '''// Package lru is a fixed-size least-recently-used cache, safe for concurrent use.
package lru

import (
\t"errors"
\t"sync"
)

// ErrCapacity is returned by New for a cache that could hold nothing.
var ErrCapacity = errors.New("lru: capacity must be positive")

type entry struct {
\tkey        string
\tvalue      []byte
\tprev, next *entry
}

// Stats counts what the cache did since it was created.
type Stats struct {
\tHits      uint64
\tMisses    uint64
\tEvictions uint64
}

// Cache maps keys to values and drops the least recently used entry when full.
type Cache struct {
\tmu       sync.Mutex
\tcapacity int
\titems    map[string]*entry
\thead     *entry // most recently used
\ttail     *entry // least recently used
\tstats    Stats
\tonEvict  func(key string, value []byte)
}

// New returns an empty cache for at most capacity entries.
func New(capacity int, onEvict func(key string, value []byte)) (*Cache, error) {
\tif capacity <= 0 {
\t\treturn nil, ErrCapacity
\t}
\treturn &Cache{capacity: capacity, items: make(map[string]*entry, capacity), onEvict: onEvict}, nil
}

func (c *Cache) unlink(e *entry) {
\tif e.prev != nil {
\t\te.prev.next = e.next
\t} else {
\t\tc.head = e.next
\t}
\tif e.next != nil {
\t\te.next.prev = e.prev
\t} else {
\t\tc.tail = e.prev
\t}
\te.prev, e.next = nil, nil
}

func (c *Cache) moveToFront(e *entry) {
\tif c.head == e {
\t\treturn
\t}
\tif e.prev != nil || e.next != nil || c.tail == e {
\t\tc.unlink(e)
\t}
\te.next = c.head
\tif c.head != nil {
\t\tc.head.prev = e
\t}
\tc.head = e
\tif c.tail == nil {
\t\tc.tail = e
\t}
}

// Get returns the value of key and marks it as recently used.
func (c *Cache) Get(key string) ([]byte, bool) {
\tc.mu.Lock()
\tdefer c.mu.Unlock()
\te, ok := c.items[key]
\tif !ok {
\t\tc.stats.Misses++
\t\treturn nil, false
\t}
\tc.stats.Hits++
\tc.moveToFront(e)
\treturn e.value, true
}

// Put stores value under key, evicting the least recently used entry when full.
func (c *Cache) Put(key string, value []byte) {
\tc.mu.Lock()
\tdefer c.mu.Unlock()
\tif e, ok := c.items[key]; ok {
\t\te.value = value
\t\tc.moveToFront(e)
\t\treturn
\t}
\tif len(c.items) >= c.capacity {
\t\tc.evictOldest()
\t}
\te := &entry{key: key, value: value}
\tc.items[key] = e
\tc.moveToFront(e)
}

func (c *Cache) evictOldest() {
\toldest := c.tail
\tif oldest == nil {
\t\treturn
\t}
\tc.unlink(oldest)
\tdelete(c.items, oldest.key)
\tc.stats.Evictions++
\tif c.onEvict != nil {
\t\tc.onEvict(oldest.key, oldest.value)
\t}
}

// Len is the number of entries in the cache.
func (c *Cache) Len() int {
\tc.mu.Lock()
\tdefer c.mu.Unlock()
\treturn len(c.items)
}

// Stats returns a copy of the cache's counters.
func (c *Cache) Stats() Stats {
\tc.mu.Lock()
\tdefer c.mu.Unlock()
\treturn c.stats
}
'''

SOURCES = (
    SourceFile("inventory.py", "python", INVENTORY_PY, ("compute_total_value", "inventory_value"),
               "a function `low_stock(inventory)` that returns the SKUs of the items that need a restock, sorted"),
    SourceFile("rate_limiter.js", "javascript", RATE_LIMITER_JS, ("refillTokens", "topUp"),
               "a function `resetClient(limiter, clientId)` that removes that client's bucket and returns whether "
               "it had one, and export it"),
    SourceFile("lru.go", "go", LRU_GO, ("moveToFront", "touch"),
               "a method `Keys() []string` that returns the keys from most to least recently used"),
)

CHAT_QUESTIONS = (
    ("explain", "Explain in a few sentences what a hash table is and why lookups in it are fast."),
    ("haiku", "Write a haiku about rain on a tin roof."),
    ("advice", "Give me three tips for sleeping better, one sentence each."),
    ("why", "Why is the sky blue? Answer in two or three sentences."),
)


def _fenced(src: SourceFile) -> str:
    return f"```{src.language}\n{src.text}```"


def rename_task(src: SourceFile) -> Task:
    old, new = src.rename
    return Task("edit", f"rename-{src.name}",
                f"Here is `{src.name}`:\n\n{_fenced(src)}\n\nRename the function `{old}` to `{new}`, including "
                f"every place that calls it. Reply with the whole updated file in one code block and nothing else.")


def extend_task(src: SourceFile) -> Task:
    return Task("edit", f"extend-{src.name}",
                f"Here is `{src.name}`:\n\n{_fenced(src)}\n\nRepeat this file exactly as it is, then add "
                f"{src.extension} at the end. Reply with the whole file in one code block and nothing else.")


def edit_tasks() -> list[Task]:
    """Per source file a rename task, then an extend task (so the first N tasks mix both)."""
    return [t for s in SOURCES for t in (rename_task(s), extend_task(s))]


def chat_tasks() -> list[Task]:
    return [Task("chat", name, text) for name, text in CHAT_QUESTIONS]


def task_ids(tokenizer, task: Task) -> list[int]:
    """The prompt's token ids: the user message through the chat template (a plain
    ``user:``/``assistant:`` frame for a model without one)."""
    if not tokenizer.has_chat_template:
        return tokenizer.encode(f"user: {task.message}\nassistant:")
    return tokenizer.apply_chat_template([{"role": "user", "content": task.message}], add_generation_prompt=True,
                                         tokenize=True)
