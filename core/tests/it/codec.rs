//! The fp8 e4m3 row codec: exact codes at known values, bounded error, round trips.

use kvwire_core::codec::*;

#[test]
fn e4m3_codes_of_known_values() {
    // Hand-derived: 1.0 = exp 7 (bias 7), mantissa 0 -> 0b0_0111_000.
    assert_eq!(to_e4m3(1.0), 0x38);
    assert_eq!(to_e4m3(-1.0), 0xB8);
    // 448 = 1.75 * 2^8 -> exp 15, mantissa 6 -> 0x7E; beyond saturates.
    assert_eq!(to_e4m3(448.0), 0x7E);
    assert_eq!(to_e4m3(1e9), 0x7E);
    // Smallest subnormal 2^-9 -> 0x01; zero -> 0.
    assert_eq!(to_e4m3(2f32.powi(-9)), 0x01);
    assert_eq!(to_e4m3(0.0), 0x00);
    // 1.0625 is halfway between 1.0 and 1.125: ties to even mantissa 0.
    assert_eq!(to_e4m3(1.0625), 0x38);
    for b in 0u8..=0xFE {
        if b & 0x7F == 0x7F {
            continue;
        }
        let v = from_e4m3(b);
        assert_eq!(to_e4m3(v), if v == 0.0 && b & 0x80 != 0 { 0x80 } else { b }, "code {b:#04x} -> {v}");
    }
}

#[test]
fn rows_round_trip_within_e4m3_precision() {
    let dim = 64;
    let vals: Vec<f32> = (0..dim).map(|i| ((i as f32) * 0.37).sin() * (1.0 + i as f32 / 8.0)).collect();
    let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    let enc = encode_rows(&bytes, 4, dim);
    assert_eq!(enc.len(), dim + 4, "one row: dim fp8 bytes + an f32 scale");
    let dec = decode_rows(&enc, 4, dim);
    let max = vals.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    for (i, v) in vals.iter().enumerate() {
        let got = f32::from_le_bytes(dec[i * 4..i * 4 + 4].try_into().unwrap());
        // 3 mantissa bits: relative error <= 2^-4, plus subnormal steps of the scale.
        let tol = v.abs() / 16.0 + max / 448.0 * 2f32.powi(-9);
        assert!((got - v).abs() <= tol, "element {i}: {v} -> {got}");
    }
    assert_eq!(Codec::parse("fp8_e4m3_row").unwrap().encoded_row(64), 68);
    assert!(Codec::parse("zstd").is_err());
}
