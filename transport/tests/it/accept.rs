//! The shared acceptance path on its own: the order of its checks and the
//! counting rule, against a registry and placement with no transport.

use kvwire_transport::accept::{self, Admitted, Incoming, Refusal};
use kvwire_transport::placement::PlacementError;
use kvwire_transport::{FlagTable, Grant, Hops, HostMem, Placement, Registry, Tag};
use std::sync::Arc;
use std::time::Instant;

fn setup() -> (Registry, Placement, u32) {
    let registry = Registry::new(8);
    let placement = Placement::new(FlagTable::new(4, 4).unwrap(), Arc::new(Hops::default()));
    let key = registry.register(Arc::new(HostMem::new("accept-test", 4096).unwrap()), 0, 4096, Some(GRANT)).unwrap().key;
    (registry, placement, key)
}

/// The node every write here comes from (its id), and the region's grant.
const S: u64 = 7;
const GRANT: Grant = Grant { peer: S, slot: 1 };

fn at(tag: Tag, key: u32, offset: u64, len: u64) -> Incoming {
    Incoming { tag, key, offset, len, stride: None }
}

/// Places nothing (the bytes are taken as already there, as for verbs).
fn landed(_: &Admitted) -> Result<Instant, Refusal> {
    Ok(Instant::now())
}

const T: Tag = Tag { slot: 1, layer: 2 };
const NO_TAG: Tag = Tag { slot: 1, layer: 9 };

#[test]
fn checks_run_key_then_bounds_then_tag_then_room() {
    let (r, p, key) = setup();
    // Each write fails every later check too; the first one names it.
    assert_eq!(accept::accept(&r, &p, S, at(NO_TAG, key ^ 1, 4090, 16), landed), Err(Refusal::UnknownKey(key ^ 1)));
    assert_eq!(
        accept::accept(&r, &p, S, at(NO_TAG, key, 4090, 16), landed),
        Err(Refusal::OutOfBounds { key, offset: 4090, len: 16, region_len: 4096 })
    );
    assert_eq!(accept::accept(&r, &p, S, at(NO_TAG, key, 0, 0), landed), Err(Refusal::ZeroLength));
    assert_eq!(accept::accept(&r, &p, S, at(NO_TAG, key, 0, 16), landed), Err(Refusal::UnknownTag { slot: 1, layer: 9 }));
    p.expect(T, 100).unwrap();
    assert_eq!(accept::accept(&r, &p, S, at(T, key, 0, 101), landed), Err(Refusal::Overrun { slot: 1, layer: 2, placed: 101, expected: 100 }));
    assert_eq!(p.placed_bytes(T), 0);
    assert_eq!(p.placed_bytes(NO_TAG), 0);
}

#[test]
fn a_refusal_never_reaches_the_placing_step() {
    let (r, p, key) = setup();
    let mut placed = false;
    let got = accept::accept(&r, &p, S, at(NO_TAG, key, 0, 16), |_: &Admitted| {
        placed = true;
        Ok::<_, Refusal>(Instant::now())
    });
    assert!(got.is_err() && !placed);
}

#[test]
fn a_range_accepted_twice_counts_once() {
    let (r, p, key) = setup();
    p.expect(T, 4096).unwrap();
    assert_eq!(accept::accept(&r, &p, S, at(T, key, 0, 2048), landed), Ok(2048));
    assert_eq!(accept::accept(&r, &p, S, at(T, key, 0, 2048), landed), Ok(0));
    // Overlapping by 1024: only the new half counts, and the room check
    // asks for no more than that.
    assert_eq!(accept::accept(&r, &p, S, at(T, key, 1024, 3072), landed), Ok(2048));
    assert_eq!(p.placed_bytes(T), 4096);
    assert!(p.flags().ready(T).is_some());
    assert_eq!(accept::accept(&r, &p, S, at(T, key, 0, 4096), landed), Ok(0), "a re-send after the flag adds nothing");
}

#[test]
fn a_region_revoked_while_its_bytes_were_placed_counts_nothing() {
    let (r, p, key) = setup();
    let got = accept::accept(&r, &p, S, at(T, key, 0, 64), |_: &Admitted| {
        r.revoke(key);
        Ok::<_, Refusal>(Instant::now())
    });
    assert_eq!(got, Err(Refusal::UnknownKey(key)));
    assert_eq!(p.placed_bytes(T), 0);
}

#[test]
fn a_failed_placing_step_counts_nothing() {
    let (r, p, key) = setup();
    let why = Refusal::SourceNotShared(7);
    assert_eq!(accept::accept(&r, &p, S, at(T, key, 0, 64), |_: &Admitted| Err(why.clone())), Err(why));
    assert_eq!(p.placed_bytes(T), 0);
}

#[test]
fn refusal_texts_are_the_protocol_ones() {
    // What a Nack carries, and what verbs' local checks say, for the same write.
    for e in [
        kvwire_core::protocol::WriteError::UnknownKey(5),
        kvwire_core::protocol::WriteError::ZeroLength,
        kvwire_core::protocol::WriteError::OutOfBounds { key: 5, offset: 1, len: 2, region_len: 2 },
    ] {
        assert_eq!(Refusal::from(e.clone()).to_string(), e.to_string());
    }
    let overrun = PlacementError::Overrun { slot: 1, layer: 2, placed: 3, expected: 2 };
    assert_eq!(Refusal::Overrun { slot: 1, layer: 2, placed: 3, expected: 2 }.to_string(), overrun.to_string());
}

#[test]
fn a_declared_only_placement_refuses_bytes_no_transfer_declared() {
    let registry = Registry::new(8);
    let p = Placement::new(FlagTable::new(4, 4).unwrap(), Arc::new(Hops::default())).declared_only();
    let key = registry.register(Arc::new(HostMem::new("accept-declared", 4096).unwrap()), 0, 4096, Some(GRANT)).unwrap().key;
    // In the table, but nobody declared it: refused before a byte lands.
    assert_eq!(accept::accept(&registry, &p, S, at(T, key, 0, 16), landed), Err(Refusal::UnknownTag { slot: T.slot, layer: T.layer }));
    assert_eq!(p.placed_bytes(T), 0);
    // Declared, then taken.
    p.expect(T, 16).unwrap();
    assert_eq!(accept::accept(&registry, &p, S, at(T, key, 0, 16), landed), Ok(16));
    assert!(p.flags().ready(T).is_some());
}

#[test]
fn only_the_granted_node_and_slot_may_write_and_that_is_checked_first() {
    let (r, p, key) = setup();
    p.expect(T, 4096).unwrap();
    let local = r.register_all(Arc::new(HostMem::new("accept-local", 4096).unwrap())).unwrap().key;
    // Out of bounds too: the grant is checked before anything else is said.
    assert_eq!(accept::accept(&r, &p, S, at(T, local, 4090, 16), landed), Err(Refusal::NotGranted(local)));
    assert_eq!(accept::accept(&r, &p, S, at(T, local, 0, 16), landed), Err(Refusal::NotGranted(local)), "a local region takes no remote write");
    assert_eq!(accept::accept(&r, &p, S + 1, at(T, key, 0, 16), landed), Err(Refusal::NotGranted(key)), "another node");
    let other_slot = Tag { slot: 2, layer: 2 };
    p.expect(other_slot, 16).unwrap();
    assert_eq!(accept::accept(&r, &p, S, at(other_slot, key, 0, 16), landed), Err(Refusal::OtherSlot { key, slot: 2, granted: 1 }));
    assert_eq!((p.placed_bytes(T), p.placed_bytes(other_slot)), (0, 0));
    assert_eq!(accept::accept(&r, &p, S, at(T, key, 0, 16), landed), Ok(16));
}
